"""`python -m baton.router_proc`: the router of data-parallel replicas (started by the launcher)."""

from baton.router_proc.process import main

main()
