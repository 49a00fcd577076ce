"""Command-line tools: the benchmark and its report, the HTTP load test, QA traffic, the embedded models' list. Each
module's `main` is a `python -m ray_specdec` command."""
