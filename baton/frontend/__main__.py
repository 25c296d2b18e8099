"""`python -m baton.frontend`: the HTTP frontend process (started by the launcher)."""

from baton.child_process import run_child
from baton.frontend.process import serve

run_child("frontend", serve)
