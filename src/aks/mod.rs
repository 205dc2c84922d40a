//! Azure Kubernetes Service: the Resource Manager client for agent pools and its tokens.

pub mod arm;
pub mod limit;
pub mod token;

pub use arm::{Accepted, AgentPool, AgentPoolRequest, ArmClient, ArmConfig, ArmError, Operation};
pub use limit::ArmLimit;
pub use token::{TokenError, TokenSource};
