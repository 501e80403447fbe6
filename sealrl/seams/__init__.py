"""Declared seams (DESIGN section 11): the protocol of each boundary that has more than one
implementation, with its capabilities as data. Standard library only, so that the config check
can read a client's capabilities without loading torch or a model library."""
