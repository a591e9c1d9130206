"""Load generators for a running service (`tinyloop loadtest`) and for the HTTP gateway (`tinyloop gateway-loadtest`)."""
