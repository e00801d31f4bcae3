"""The worker side: the run guard around each delivery, and the
background tasks of a worker process (leases, releases, hand-off
polls).  A worker also sends (a delayed copy, a hand-off), so it may
import the send side; the send side never imports it.
"""
