"""Placeholder."""
def main() -> None:
    pass
