"""Tests of the bus package (contract suite over both buses, Redis fault tests)."""
