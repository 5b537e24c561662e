import pytest

# Helpers that assert on behalf of tests: pytest explains their failures like a test's own.
pytest.register_assert_rewrite("tests.common")
