"""The frozen executable's entry point: the same `main` as `python -m tinygw`.

First, this process (the one the PyInstaller bootloader unpacked and started) asks to
die with the bootloader: killed, the bootloader cannot stop it, and it would go on
serving (tinygw.lifecycle). Then `main` calls `multiprocessing.freeze_support()`, so
that Granian's spawned workers (which re-run this executable) become workers, not
another CLI."""

from tinygw.lifecycle import die_with_bootloader

die_with_bootloader()

from tinygw.cli import main  # noqa: E402 (after the request to die with the bootloader)

main()
