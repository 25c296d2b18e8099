"""The router of data-parallel replicas (--data-parallel-size): takes the messages meant for the
scheduler and gives each request to one replica's scheduler by --load-balance-method, each
abort and pause to the replica running its request, and every stats request and Shutdown to
all."""
