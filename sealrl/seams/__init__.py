"""Declared seams (DESIGN section 11): the protocol of each boundary that has more than one
implementation, with its capabilities as data (rollout.py), and the one way to run a role in
another process of this machine (host.py; on other machines, placement/workers.py's Ray hosts).
Standard library only, so that the config check can read a client's capabilities without loading
torch or a model library."""
