"""The CPU as the engine sees it: its capabilities, the compute plan chosen from them, the
decode steps timed at start-up for choices that depend on this machine, and the vector math
set-up. Imports nothing of the engine."""
