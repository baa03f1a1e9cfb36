//! What a recorded step graph is made of: its nodes counted by type, read from the graph being
//! captured just before the capture ends. Kernel nodes chain with programmatic dependent launch;
//! a memset, copy or event node between two kernels makes the second wait for the first's whole
//! grid and the node itself, so the count says where a step pays for more than its kernels.
//!
//! Owns: the census and its log line. Must not touch: the recording itself (step_graph.rs).

use std::fmt;

use cudarc::driver::sys;

/// Nodes of one graph by type.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct GraphCensus {
    pub kernels: usize,
    pub memsets: usize,
    pub copies: usize,
    pub event_records: usize,
    pub event_waits: usize,
    pub other: usize,
}

impl GraphCensus {
    /// Counts `types`, each a node's type.
    fn of_types(types: impl IntoIterator<Item = sys::CUgraphNodeType>) -> Self {
        let mut census = Self::default();
        for node_type in types {
            match node_type {
                sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => census.kernels += 1,
                sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET => census.memsets += 1,
                sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY => census.copies += 1,
                sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EVENT_RECORD => census.event_records += 1,
                sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_WAIT_EVENT => census.event_waits += 1,
                _ => census.other += 1,
            }
        }
        census
    }

    /// The nodes of the graph `stream` is capturing, or `None` where the driver does not say
    /// (not capturing, or a call failed: the census is only a diagnostic).
    pub(super) fn of_capture(stream: sys::CUstream) -> Option<Self> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id: sys::cuuint64_t = 0;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        let mut dependencies: *const sys::CUgraphNode = std::ptr::null();
        let mut dependency_count: usize = 0;
        // SAFETY: every out-pointer points at a live local of the type the driver writes.
        let status_read = unsafe {
            sys::cuStreamGetCaptureInfo_v2(
                stream,
                &mut status,
                &mut id,
                &mut graph,
                &mut dependencies,
                &mut dependency_count,
            )
        };
        if status_read != sys::CUresult::CUDA_SUCCESS
            || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
            || graph.is_null()
        {
            return None;
        }
        let mut count: usize = 0;
        // SAFETY: a null node array asks only for the count.
        let counted = unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count) };
        if counted != sys::CUresult::CUDA_SUCCESS {
            return None;
        }
        let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); count];
        // SAFETY: `nodes` holds `count` entries, the number the driver just gave.
        let listed = unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count) };
        if listed != sys::CUresult::CUDA_SUCCESS {
            return None;
        }
        nodes.truncate(count);
        let mut types = Vec::with_capacity(nodes.len());
        for node in nodes {
            let mut node_type = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: `node` is a node of the live graph; `node_type` a live local.
            if unsafe { sys::cuGraphNodeGetType(node, &mut node_type) }
                != sys::CUresult::CUDA_SUCCESS
            {
                return None;
            }
            types.push(node_type);
        }
        Some(Self::of_types(types))
    }
}

impl fmt::Display for GraphCensus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} kernels, {} memsets, {} copies, {} event records, {} event waits, {} other nodes",
            self.kernels,
            self.memsets,
            self.copies,
            self.event_records,
            self.event_waits,
            self.other
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_each_node_type_once() {
        use sys::CUgraphNodeType::*;
        let census = GraphCensus::of_types([
            CU_GRAPH_NODE_TYPE_KERNEL,
            CU_GRAPH_NODE_TYPE_KERNEL,
            CU_GRAPH_NODE_TYPE_MEMSET,
            CU_GRAPH_NODE_TYPE_MEMCPY,
            CU_GRAPH_NODE_TYPE_EVENT_RECORD,
            CU_GRAPH_NODE_TYPE_WAIT_EVENT,
            CU_GRAPH_NODE_TYPE_HOST,
        ]);
        assert_eq!(
            census,
            GraphCensus {
                kernels: 2,
                memsets: 1,
                copies: 1,
                event_records: 1,
                event_waits: 1,
                other: 1,
            }
        );
        assert_eq!(
            census.to_string(),
            "2 kernels, 1 memsets, 1 copies, 1 event records, 1 event waits, 1 other nodes"
        );
    }
}
