"""`python -m serve`: an alias of `python -m deepinfer.serve`, run from a source checkout.

The server lives in deepinfer/serve/. This directory only keeps the short command working in
the repository root; setup.py installs `deepinfer*` packages only, so nothing named `serve`
lands in site-packages.
"""
