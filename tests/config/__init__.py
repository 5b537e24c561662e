"""Tests of config/: the YAML schema, its error messages, ``${VAR}`` interpolation, hot reload."""
