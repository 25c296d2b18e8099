"""`python -m baton.detokenizer_proc`: the detokenizer process (started by the launcher)."""

from baton.child_process import run_child
from baton.detokenizer_proc.process import serve

run_child("detokenizer", serve)
