"""``python -m ringlet.distributed.run``: the launcher, at torch's path (see
ringlet.launcher.run)."""

from ringlet.launcher.run import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
