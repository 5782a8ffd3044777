"""The ground floor: configuration, crash-safe files, run
folders, checkpoints, precision. Imports no model code."""
