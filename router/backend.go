package router

// MetadataPartitionKey is the metadata entry the forwarder sets to the
// chosen partition key; the Kafka backend uses it as the record key.
const MetadataPartitionKey = "partition_key"
