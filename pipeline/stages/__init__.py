"""One module per pipeline stage. Each stage reads its inputs, calls the library below it, writes
its outputs atomically and returns its typed report; the CLI and dvc.yaml call these functions."""
