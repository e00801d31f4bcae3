"""The worker side: the run lock around each delivery (``take``,
``release``), and the background tasks of a worker process (leases,
batched releases and their retries, hand-off polls, the periodic
reaper).  A worker also sends (a delayed copy, a hand-off), so it may
import the send side; the send side never imports it.
"""
