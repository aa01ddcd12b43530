"""Coverage-guided fuzzing (atheris) of the two decoders that read bytes from outside the process."""
