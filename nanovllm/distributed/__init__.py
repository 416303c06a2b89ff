"""Scale-out over many engines on Ray."""
