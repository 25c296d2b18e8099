"""`python -m baton.tokenizer_proc`: the tokenizer process (started by the launcher)."""

from baton.child_process import run_child
from baton.tokenizer_proc.process import serve

run_child("tokenizer", serve)
