"""The operators' side: inspecting, releasing and reaping locks, the
``dramatiq-unique`` command, metrics and the demo.  It may import any
other side.
"""
