"""Speculative decoding: proposing draft tokens (n-grams or a draft model) and verifying them
against the target model. Receives what it needs of the engine (`setup.TargetEngine`) rather
than importing it; imports every room below it."""
