"""The frozen configs of the commands and their checks, made before anything is allocated."""
