"""wsync-conformance: the suite that proves a transport keeps wsync's guarantees."""
