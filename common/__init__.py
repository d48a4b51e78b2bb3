"""The lowest floor: small helpers with no import of the project, for every package above."""
