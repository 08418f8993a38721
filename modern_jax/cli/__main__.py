"""`python -m modern_jax.cli ...`, the `modern-jax` command: how `plan` re-runs itself in a fresh
process and `launch` starts its processes."""

import sys

from modern_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
