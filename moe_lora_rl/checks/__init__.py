"""Distributed test/bench harness: run many checks per torchrun launch (imports cost 5-13 s per rank)."""
