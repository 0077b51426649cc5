"""Analysis tools that run the model on meta tensors or the NKI interpreter (memory report, dry run,
kernel report). They import the runtime packages; no runtime package imports them
(tests/repo/test_import_cycles.py)."""
