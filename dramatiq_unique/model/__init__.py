"""The model: what a lock type is and what an actor's lock options
mean.  It imports nothing of the other sides.
"""
