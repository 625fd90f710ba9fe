package puller

// ParseMountInfo exposes parseMountInfo to the package's external tests.
var ParseMountInfo = parseMountInfo
