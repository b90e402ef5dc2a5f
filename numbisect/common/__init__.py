"""Errors and exit codes, safe file IO, printable text, JSON-safe values, number formatting,
`--threshold` parsing: torch-free, the bottom layer everything else imports."""
