"""What the scheduler hands the engine for one step (`ForwardBatch`) and what comes back, with the
per-request state its rows carry: a constrained request's grammar matcher and a seeded
request's random source, both built by the scheduler at admission. Imports nothing of the
engine."""
