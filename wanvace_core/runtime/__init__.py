"""How a loaded pipeline runs: the ordered runtime plan (`plan`) and what it applies."""
