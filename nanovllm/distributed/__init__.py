"""Scale-out beyond one machine, on existing distributed engines (Ray)."""
