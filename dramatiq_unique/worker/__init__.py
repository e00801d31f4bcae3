"""The worker side: the run lock around each delivery, and a worker process's background tasks.
A worker also sends (a delayed copy, a hand-off), so it may import the send side, never the reverse.
"""
