import sys

from .cli import main

if __name__ == "__main__":  # guarded: spawned worker processes (speech to text) re-import it
    sys.exit(main())
