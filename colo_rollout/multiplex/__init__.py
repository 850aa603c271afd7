"""The P/D multiplexing method: typed scheduling strategies (Normal, Global, Fine), the distributed turnstile, span (segment) policies, the rendezvous, and the selective stream route."""
