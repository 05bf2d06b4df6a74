//! stead's scenario tests, one module per area, in one test binary: the runtime and
//! RocksDB are linked once for all of them. (`metrics_memory`, which installs a counting
//! global allocator, is a binary of its own.)

mod agent_support;
mod api_support;
mod etcd_support;
mod exec_support;
mod sim_support;

mod agent_bounds;
mod agent_shutdown;
mod alloc_scenarios;
mod api_auth;
mod api_bounds;
mod api_endpoints;
mod api_metrics;
mod check_agent;
mod cli_commands;
mod cli_proxy;
mod cli_status;
mod cli_suggest_agent;
mod config_agent;
mod device_plugin_agent;
mod device_scenarios;
mod exec_agent;
mod exec_cli_agent;
mod exec_driver;
mod exec_scenarios;
mod fleet_agent;
mod gpu_agent;
mod hardening_agent;
mod interpolation_agent;
mod lifecycle_agent;
mod limits_agent;
mod metrics_agent;
mod packaging;
mod scale_agent;
mod sim;
mod sim_fleet;
mod spec_agreement;
mod spec_fixtures;
mod spec_revision;
mod spec_roundtrip;
mod spec_schema;
mod spec_source;
mod specs_dir;
mod state_crash;
mod state_restore;
mod state_store;
mod tidy;
mod ui_browser;
mod ui_page;
