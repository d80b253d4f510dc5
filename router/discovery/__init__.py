"""What the router knows of its pool: worker records from etcd, their KV events, the block
index they feed, and the view the request path reads."""
