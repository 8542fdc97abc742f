"""The GPU check: what each part runs, bounded by the lent minutes, and its report."""
