"""NKI kernels (our own), each with a torch wrapper taking its reference's argument list."""
