"""Tools for developing cupygpt, run from the repository's root (python -m dev.NAME): the
GPU check, the static GPU model, the side-by-side runs against llm.c. The wheel does not
carry them and cupygpt never imports them."""
