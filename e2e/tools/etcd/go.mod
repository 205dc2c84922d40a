// Builds etcd from its published server module: etcd's own go.mod has replace lines, so
// `go install go.etcd.io/etcd/server/v3@version` refuses it; a module of ours does not.
module ringmaster.dev/e2e/tools/etcd

go 1.26.0

require go.etcd.io/etcd/server/v3 v3.6.16
