"""The resume-equivalence gate's probe and judge: each rank's whole state written at chosen
steps (state_dump, hook) and two runs' dumps compared byte for byte (compare)."""
