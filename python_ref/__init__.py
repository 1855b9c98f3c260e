"""Pure-Python references of every op: readable loops, obviously right, used by tests only."""
