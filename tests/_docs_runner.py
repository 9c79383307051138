"""Runs documentation blocks inside each worker of one ``ringlet-run`` launch (see test_docs.py).

Usage: ``ringlet-run --nproc-per-node N tests/_docs_runner.py BLOCKS.json``.  Each block runs in
a fresh namespace as ``__main__``; a process group it leaves initialized is destroyed before
the next block.  The first failing block ends the worker with its location and traceback.
"""

from __future__ import annotations

import json
import sys
import traceback

import ringlet.distributed as dist


def main(path: str) -> int:
    with open(path) as f:
        todo = json.load(f)
    for item in todo:
        try:
            code = compile(item["code"], item["where"], "exec")
            exec(code, {"__name__": "__main__"})  # noqa: S102 - running the docs is the point
        except BaseException:
            print(f"DOC BLOCK FAILED: {item['where']}\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
            return 1
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        print(f"DOC BLOCK OK: {item['where']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
