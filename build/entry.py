"""The frozen executable's entry point: the same `main` as `python -m tinygw`.

`main` calls `multiprocessing.freeze_support()` first, so that Granian's spawned
workers (which re-run this executable) become workers, not another CLI."""

from tinygw.cli import main

main()
