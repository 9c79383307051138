"""``python -m ringlet.distributed.launch``: torch's deprecated launcher, for scripts still started
that way (see ``ringlet.launcher.launch``)."""

from ringlet.launcher.launch import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
