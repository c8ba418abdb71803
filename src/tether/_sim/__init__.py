"""``tether sim``: a deterministic simulation of tether's protocol core in virtual time."""
