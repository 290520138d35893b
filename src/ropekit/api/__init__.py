"""The public ops: each parses its call once into the core's record and goes through the core."""
