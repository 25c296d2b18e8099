"""`python -m baton.scheduler_proc`: the scheduler process (started by the launcher)."""

from baton.scheduler_proc.process import main

main()
