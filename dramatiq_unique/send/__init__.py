"""The send side: the enqueue guard, replace and debounce, the send
fast path and the confirmer of provisional locks.  It imports the model
and the backends, never the worker.
"""
